"""A Kubernetes cluster on one machine, for `kvfleet demo` and the tests: an API server that
validates like a real one (`apiserver`), a kubelet and Deployment controller that run real
runtime processes as pods (`kubelet`), and the demo itself (`demo`).

Never part of what runs in a cluster: the operator image does not install its dependencies
(the `dev` extra), and the operator never imports it. It may import the operator and `kvfleet/`
(contract.py), never the runtime or the kernels: it runs with the operator's dependencies plus
the dev extra. Importing this package, or `demo.cmd_demo` (which every `kvfleet` invocation
imports), loads nothing but the standard library.
"""
