"""A Kubernetes API server emulator built on kmock that refuses what a real one refuses:
`emulator.RealisticEmulator` serves the resources; admission (CRD schemas, defaults, pruning,
CEL rules; built-in schemas at the chart's minimum Kubernetes; the server's own rules),
server-side apply with managedFields, selectors, watches and garbage collection are the
modules beside it; `rbac_authorizer` says what RBAC would allow of the requests it served."""
