"""The running driver, `dra-driver run`: its configuration, parsed once (`config`), the
checks made before anything is created on the host (`preflight`), the node's roots
(`node`), the parts made and wired (`assembly`), started and stopped in the kubelet's order
(`plugin`), the loops beside serving (`loops`), and what `dra-driver status` and
`discover` show of the node (`nodeview`, `report`).

It sits above every other part and below the CLI: it may import any part of the driver,
and only `driver.cli` imports it.
"""
