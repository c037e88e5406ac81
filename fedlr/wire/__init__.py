"""The wire between server and nodes: record names and keys, decoding
(protocol.py), the node's instruction checks (checks.py), the factored FedEx
downlink, fingerprints of frozen weights, the payload kinds.
"""
