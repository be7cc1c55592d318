"""Kubelet PodResources v1 API: the proto, its generated Python modules, an async client and device-id parsing.

* ``api.proto`` — the kubelet's ``v1`` PodResources API (package ``v1``: method paths ``/v1.PodResourcesLister/...``).
* ``api_pb2.py``, ``api_pb2.pyi``, ``api_pb2_grpc.py`` — generated from it; do not edit. Regenerate from the
  repository root with::

      .venv/bin/python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. \\
          services/collector/podresources/api.proto \\
      && sed -i 's/^from services\\.collector\\.podresources import api_pb2 as/from . import api_pb2 as/' \\
          services/collector/podresources/api_pb2_grpc.py

  (the sed makes the grpc module import its pb2 sibling package-relatively; the proto is registered in the
  descriptor pool as ``services/collector/podresources/api.proto`` so it cannot clash with another ``api.proto``).
* ``client.py`` — ``PodResourcesClient`` (grpc.aio over the kubelet's unix socket) and its typed errors.
* device ids and GPU resource names: ``schemas.devices`` (shared with the attributor and the guard).
"""
