#!/usr/bin/env bash
# run_python_test.sh PYTHON IMPORTS HOW TEST: runs one Python test method (module.Class.test_x)
# with PYTHON (Debian's /usr/bin/python3, or a venv's python under build/venvs), after checking
# that it can import IMPORTS ("numpy, torch"). The check is made here, when the test runs, not
# when CMake configures: a build folder made before `tools/test` made the venv must still run
# these tests afterwards. When it cannot, the test fails saying HOW to install what is missing.
set -u
python=$1 imports=$2 how=$3 test=$4
if [ ! -x "$python" ]; then
  echo "no $python: $how"
  exit 1
fi
if ! err=$("$python" -c "import $imports" 2>&1); then
  echo "$python cannot import $imports: $how"
  echo "$err" | tail -n 1
  exit 1
fi
exec "$python" -m unittest -v "$test"
