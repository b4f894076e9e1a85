"""Contracts both router and worker speak, below both: sampling parameters (sampling.py),
validated requests and peer hints (requests.py) and their protobuf conversion (wire.py).
Torch-free; imports only the generated stubs in proto/."""
