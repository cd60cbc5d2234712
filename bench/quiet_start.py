"""Starting JAX without the CUDA plugin's no-driver notices on a CPU machine.

The `test` extra installs jax's CUDA plugin (`jax_cuda12_plugin`, `jax_plugins.xla_cuda12`)
so that the Triton kernels can be lowered for CUDA on a machine without a GPU. Its shared
libraries link a CUDA runtime stub whose C++ initialiser, on a machine with no NVIDIA
driver, logs through absl before absl is initialised:

    WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
    I0000 ... cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.

three times at `import jax` (jaxlib loads the plugin's kernel libraries) and once more when
the backends start. They are written by C++ straight to file descriptor 2, ignore
TF_CPP_MIN_LOG_LEVEL (that variable sets TSL's log level, not absl's pre-initialisation
sink), and say nothing a CPU user can act on. JAX_PLATFORMS=cpu does not stop them: the
plugin is imported either way, and must be, since CUDA lowering uses it.

`start_jax_quietly()` imports jax and starts its backends with fd 2 sent to a temporary
file, then writes back every captured line except those two exact notices: an error or a
warning printed meanwhile still reaches the user (after the start rather than during it).
On a machine with an NVIDIA driver it does nothing special. Call it after setting
JAX_PLATFORMS / XLA_FLAGS and before anything else imports jax.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator

NOTICES = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} [\d:. ]+\d+ cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine, "
    r"GPU will not be used\."
)


def has_nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None or os.path.exists("/dev/nvidia0")


@contextlib.contextmanager
def dropping_notices(pattern: re.Pattern[str] = NOTICES) -> Iterator[None]:
    """Captures file descriptor 2 (C++ and Python writes alike) inside the block; on the
    way out, exception or not, writes every line that is not wholly a `pattern` match."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            lines = capture.read().decode(errors="replace").splitlines(keepends=True)
            kept = [line for line in lines if not pattern.fullmatch(line.rstrip("\r\n"))]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def start_jax_quietly() -> None:
    """Imports jax and initialises its backends, without the no-driver notices when this
    machine has no NVIDIA driver (see the module docstring)."""
    if has_nvidia_driver():
        return
    with dropping_notices():
        import jax

        jax.devices()
