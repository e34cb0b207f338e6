"""What the driver keeps on the node's disk and who may touch it: atomic writes (`atomic`),
the checkpoint of prepared claims (`checkpoint`), file locks (`locks`) and the record of which
driver instances run on the node (`instance`; two run side by side during an upgrade).

May import `driver.kube` (names) and the instruments only; the formats on disk are kept
stable across releases."""
