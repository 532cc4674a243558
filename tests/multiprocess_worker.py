"""One process of a 2-process x 4-CPU-device elastic run (launched by test_parallel.py):
python multiprocess_worker.py PROCESS_ID PORT WORKDIR STOP_AFTER."""
import os
import pathlib
import sys

# test_parallel passes 4 devices (with the suite's other XLA flags); run alone, 4 devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from elastic_jax.parallel import distributed  # noqa: E402

pid, port, workdir, stop_after = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
assert distributed.initialize(f"127.0.0.1:{port}", 2, pid)

import jax  # noqa: E402

from test_parallel import elastic_run  # noqa: E402

assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
elastic_run(pathlib.Path(workdir), process=(pid, 2), stop_after=stop_after)
print(f"process {pid}: done", flush=True)
