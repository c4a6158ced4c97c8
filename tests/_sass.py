"""SASS of a dumped PTX kernel, and which instructions sit inside its loops (no GPU needed).

The Mosaic-GPU compile (the CUDA plugin, `MOSAIC_GPU_DUMP_TO`) leaves each kernel's PTX; here
ptxas assembles it for sm_90a and nvdisasm prints the SASS (the plugin's own SASS dump calls a
fixed /usr/local/cuda/bin/nvdisasm). Tools are looked up in pip's NVIDIA wheels
(`nvidia-cuda-nvdisasm`, in the test extra), triton's bundled binaries, then PATH and
/usr/local/cuda/bin; the first ptxas that accepts the PTX's `.version` is used, so the check
needs no more than the plugin's own compile does.

A loop is a predicated backward branch: `@P BRA` to a label above it. ptxas puts a barrier's
retry spin out of line, after the kernel's exit: a few instructions branching back to
themselves, then an unconditional `BRA` back into the main code (backward, but not a loop), so
"in a loop" here means inside a loop of at least `MIN_LOOP` instructions closed by a predicated
branch: the kernels' main loops.
"""
from __future__ import annotations

import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess

MIN_LOOP = 32  # instructions; the barrier retry spins are < 10


def _candidates(tool: str) -> list[str]:
  found = []
  for pkg in ("nvidia", "triton"):
    spec = importlib.util.find_spec(pkg)
    for root in (spec.submodule_search_locations or []) if spec else []:
      found += sorted(glob.glob(os.path.join(root, "**", "bin", tool), recursive=True))
  which = shutil.which(tool)
  if which:
    found.append(which)
  found += [f"/usr/local/cuda/bin/{tool}"]
  return [p for p in dict.fromkeys(found) if os.path.isfile(p) and os.access(p, os.X_OK)]


def unavailable() -> str | None:
  """Why SASS cannot be produced here (no ptxas / nvdisasm found), or None."""
  if not _candidates("ptxas"):
    return "no ptxas (install the CUDA toolkit or the aot-gpu extra)"
  if not _candidates("nvdisasm"):
    return "no nvdisasm (pip install nvidia-cuda-nvdisasm: the test extra has it)"
  return None


def sass(ptx_path: str, arch: str = "sm_90a") -> str:
  """nvdisasm's listing of the cubin ptxas makes from `ptx_path` for `arch`."""
  cubin = ptx_path + f".{arch}.cubin"
  errors = []
  for ptxas in _candidates("ptxas"):
    r = subprocess.run([ptxas, f"-arch={arch}", ptx_path, "-o", cubin], capture_output=True,
                       text=True, timeout=300)
    if r.returncode == 0:
      break
    errors.append(f"{ptxas}: {r.stderr.strip()[-300:]}")
  else:
    raise RuntimeError("no ptxas assembled the PTX: " + "; ".join(errors))
  (nvdisasm, *_) = _candidates("nvdisasm")
  r = subprocess.run([nvdisasm, cubin], capture_output=True, text=True, timeout=300)
  if r.returncode != 0:
    raise RuntimeError(f"{nvdisasm}: {r.stderr.strip()[-300:]}")
  return r.stdout


_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_INSTR = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)")
_BRANCH = re.compile(r"@!?U?P\w+\s+BRA\s+`\((\.L_x_\d+)\)")  # a predicated branch


@dataclasses.dataclass(frozen=True)
class Listing:
  """A kernel's instructions (opcodes in order) and its loops ([start, end] index ranges)."""
  opcodes: tuple[str, ...]
  loops: tuple[tuple[int, int], ...]

  @classmethod
  def parse(cls, text: str) -> Listing:
    opcodes, labels, loops = [], {}, []
    for line in text.splitlines():
      m = _LABEL.match(line)
      if m:
        labels[m[1]] = len(opcodes)
        continue
      m = _INSTR.match(line)
      if not m:
        continue
      b = _BRANCH.search(line)
      if b and b[1] in labels and labels[b[1]] <= len(opcodes):  # backward: a loop
        loops.append((labels[b[1]], len(opcodes)))
      opcodes.append(m[1])
    return cls(tuple(opcodes), tuple(loops))

  def count(self, prefix: str, *, in_loops: bool = False) -> int:
    """Instructions whose opcode starts with `prefix` (only inside main loops if in_loops)."""
    main = [(a, b) for a, b in self.loops if b - a >= MIN_LOOP]
    return sum(1 for i, op in enumerate(self.opcodes) if op.startswith(prefix)
               and (not in_loops or any(a <= i <= b for a, b in main)))
