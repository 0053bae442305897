"""A kubelet and Deployment controller for a cluster with no nodes: `simulator.KubeletSim`
runs each wanted replica of a Deployment as a real `kvfleet` process on a loopback address of
its own, and writes the Pod and Deployment objects a real cluster would."""
