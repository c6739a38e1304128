# s11/step.py with extra gcc flags for the forced variant (a separate build, cached by its flags):
# EXTRA="-DSD_PASS=6" SPECDECODE_KERNEL_ISA=avxvnni python step_flags.py MODEL CTX KS N
import os, sys, runpy
from pathlib import Path
from specdecode import lowbit_kernels as lk
isa = os.environ["SPECDECODE_KERNEL_ISA"]
need, flags, macro = lk.VARIANTS[isa]
lk.VARIANTS[isa] = (need, flags + os.environ.get("EXTRA", "").split(), macro)
sys.argv = ["step.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[2] / "s11" / "step.py"), run_name="__main__")
