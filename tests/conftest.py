"""Session set-up for the test suite."""

import os

# The bench commands the tests run in this process leave its C heap as glibc has it
# (tensorplace.bench.common.host_malloc; tests/test_host_malloc.py checks "keep" in a child).
os.environ["TENSORPLACE_HOST_MALLOC"] = "default"
