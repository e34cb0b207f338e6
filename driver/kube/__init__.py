"""The Kubernetes API: the connection to the API server (`client`, and `asyncclient` for
claim reads on the event loop), how it is configured (`kubeconfig`: in-cluster or a
kubeconfig file), and the API's own value types every layer speaks (`names`: the object and
device name rules; `quantity`: resource quantities) and the `resource.k8s.io` versions we
speak (`client.API_GROUP`, `API_VERSIONS`).

It is the lowest package of ours after the instruments (`driver.logs`, `driver.metrics`,
`driver.aio`): it imports nothing else of the driver, so devices, state on disk, publishing
and preparing can all use it."""
