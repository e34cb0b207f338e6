"""The driver's NRI plugin: claimed NICs moved into pods' network namespaces from the
container runtime's pod sandbox hooks (docs/networking.md)."""
