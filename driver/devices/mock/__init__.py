"""Mock-device mode: a fake NVML and a generated sysfs/dev/proc tree for a profile.

Nothing in discovery, publishing or prepare knows it runs on a mock: the fake NVML answers
the same calls as `pynvml`, and the trees are read through `--sysfs-root`/`--dev-root`.
"""

from driver.devices.mock.profile import Profile, ProfileError, builtin_profiles, load, parse
from driver.devices.mock.tree import MockNode, attach, build

__all__ = ["MockNode", "Profile", "ProfileError", "attach", "build", "builtin_profiles", "load",
           "parse"]
