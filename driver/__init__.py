"""Kubernetes DRA driver for GPUs, FPGAs and NICs."""

__version__ = "0.1.0"


def needs_demo_extra(command: str, module: str | None) -> str:
    """The one line every command that evaluates CEL (explain, demo) prints without the
    `demo` extra: what is missing and the two ways to install it (the package is installed
    from a checkout; the driver's image has neither)."""
    return (f"dra-driver {command}: needs cel-python ({module or 'cel-python'} is not "
            "installed), the [demo] extra: pip install -e '.[demo]' in the checkout, or "
            "pip install 'cel-python>=0.5'")


def _quiet_interrupt() -> None:
    """The `dra-driver` command: a Ctrl-C that comes while Python is still importing it
    (before any command has its own handler) ends it without a traceback."""
    import os
    import sys

    if os.path.basename(sys.argv[0]) != "dra-driver" and sys.argv[:1] != ["-m"]:
        return  # imported as a library (tests, tools): leave the interpreter alone
    default = sys.excepthook

    def hook(kind, value, tb):
        if not issubclass(kind, KeyboardInterrupt):
            default(kind, value, tb)

    sys.excepthook = hook


_quiet_interrupt()
