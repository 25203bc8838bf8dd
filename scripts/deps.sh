#!/usr/bin/env bash
# Install what lina needs from Debian's packages, if it is missing.
# Run as root (as CI does); otherwise it says what to install and stops.
set -euo pipefail

packages=(g++ make cmake ninja-build libboost-dev libfmt-dev doctest-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" -ne 0 ]; then
  echo "lina needs these Debian packages: ${missing[*]}" >&2
  echo "install them (sudo apt-get install -y ${missing[*]}) or run this script as root" >&2
  exit 1
fi
echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${missing[@]}" ||
  { apt-get update && apt-get install -y --no-install-recommends "${missing[@]}"; }
