import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The tests' CPU cases take a CPU slot of their own, not the machine's (slapo_ae.harness.runner):
# a test run never waits for, or holds up, a workflow measuring on the same machine.
os.environ.setdefault("SLAPO_CPU_LOCK_DIR", tempfile.mkdtemp(prefix="slapo-tests-cpu-slot-"))
