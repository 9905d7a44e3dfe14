"""What the cc-sentiment scripts share: answering the platform checks of
spawnllm's `MlxEngine` and cc-sentiment's `sentiment` module (both refuse to
run off macOS on Apple Silicon) as an Apple Silicon Mac would, for the span
of a `with` block, and changing nothing else."""

import platform
import sys


class ApplePlatform:
    """sys.platform and platform.machine() as on an Apple Silicon Mac."""

    def __enter__(self):
        self.saved = (sys.platform, platform.machine)
        sys.platform = "darwin"
        platform.machine = lambda: "arm64"

    def __exit__(self, *_):
        sys.platform, platform.machine = self.saved
