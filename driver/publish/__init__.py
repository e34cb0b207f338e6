"""From inventory to ResourceSlices: how devices are grouped into slices (`slices`), the
publisher that writes them with the fewest requests (`publisher`, comparing with the
watched copy in `slicecache`), rediscovery on hotplug (`hotplug`), the DeviceClasses and
the extended-resource names we offer (`deviceclasses`, `extendedresources`).

May import `driver.kube`, `driver.devices`, `driver.state` and the instruments; never the
prepare side, monitoring or the service that runs it."""
