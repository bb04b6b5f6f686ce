#!/usr/bin/env bash
# run_python_test.sh IMPORTS PACKAGE TEST: runs one Python test method (module.Class.test_x)
# with /usr/bin/python3, after checking that it can import IMPORTS ("numpy, torch"). The
# check is made here, when the test runs, not when CMake configures: a build folder made
# before `tools/test` installed python3-torch must still run the torch tests afterwards.
set -u
imports=$1 package=$2 test=$3
if ! err=$(/usr/bin/python3 -c "import $imports" 2>&1); then
  echo "/usr/bin/python3 cannot import $imports: apt-get install $package (tools/test does)"
  echo "$err" | tail -n 1
  exit 1
fi
exec /usr/bin/python3 -m unittest -v "$test"
