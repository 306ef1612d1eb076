# 8 fake CPU devices for the EP tests. The top-level tests/conftest.py sets this before JAX is imported;
# this is a fallback for running this directory alone (it only helps if JAX is not imported yet).
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
