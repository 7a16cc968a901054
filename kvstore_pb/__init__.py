"""Generated wire contract of the Strata store (from proto/kvstore_pb/*.proto).

Regenerate with `python scripts/gen_proto.py`; do not edit the *_pb2* modules by hand.
"""

API_VERSION = 1
