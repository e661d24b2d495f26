"""Test configuration shared by the whole suite.

Eight simulated CPU devices let sharding tests run on a machine without accelerators; the flag
must be set before JAX initialises its backend, hence here and not in a fixture.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
