import os

# torch threads thrash on small CPU boxes (ENV-NOTES); every test process and Ray worker uses one.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Triton kernels run in the interpreter on CPU-only machines. The variable must be set before any
# module defining @triton.jit kernels is imported — and the lightning dispatch imports them lazily
# from whichever test gets there first — so it is set here, once, for the whole session.
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
