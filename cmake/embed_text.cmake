# cmake -DINPUT=<file> -DOUTPUT=<file> -P embed_text.cmake
# Writes INPUT's text as one C++ raw string literal, to be #included as an initializer.
file(READ ${INPUT} text)
string(FIND "${text}" ")lina_text\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw string delimiter )lina_text\"")
endif()
file(WRITE ${OUTPUT}.tmp "R\"lina_text(${text})lina_text\"\n")
file(COPY_FILE ${OUTPUT}.tmp ${OUTPUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUTPUT}.tmp)
