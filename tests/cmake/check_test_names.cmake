# A doctest binary's test case names must not hold ';': doctest_discover_tests
# would split such a name into two ctest entries that each match no test case
# and pass without running anything (four cases went unrun in CI that way).
execute_process(COMMAND ${EXE} --list-test-cases OUTPUT_VARIABLE names RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${EXE} --list-test-cases failed (${rc})")
endif()
string(REPLACE "\n" "|" lines "${names}")
string(FIND "${names}" ";" at)
if(NOT at EQUAL -1)
  string(REGEX MATCHALL "[^|]*;[^|]*" bad "${lines}")
  message(FATAL_ERROR "test case names with ';' (ctest would split them and run nothing): ${bad}")
endif()
message(STATUS "no test case name of ${EXE} holds ';'")
