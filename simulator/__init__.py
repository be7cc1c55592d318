"""The simulated cluster of a scenario, for tests, ``gpumeter replay`` and ``gpumeter collector --simulate``.

Its parts: ``scenario`` (the YAML format), ``world`` (GPUs, pods, processes and ground truth at any instant),
``nvml_driver`` (what libnvidia-ml answers, under nvidia-ml-py's own code), ``kubelet`` (a PodResources gRPC
server), ``apiserver`` (a Kubernetes API server). It imports nothing of ``services`` but the kubelet PodResources stubs (``services.collector.podresources``)
that ``kubelet`` serves.
"""
