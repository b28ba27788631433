import os

# Planning compiles tensor-parallel layers on fake CPU devices (compile only): give the CLI
# eight unless the user chose. Must happen before JAX is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()

from harpjax.cli import run  # noqa: E402

if __name__ == "__main__":
  run()
