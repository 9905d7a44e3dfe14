"""The kernel's count of this process's reads, for the engine bench's
Python peers (`llama_cpp_peer.py`, `mlx_lm_batch.py`)."""


def read_io():
    """Bytes returned by read calls, and bytes fetched from storage
    (`/proc/self/io`, Linux); zeros elsewhere."""
    try:
        fields = dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())
        return int(fields["rchar"]), int(fields["read_bytes"])
    except OSError:
        return 0, 0
