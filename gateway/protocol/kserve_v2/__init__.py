"""Generated stubs of protos/kserve/v2/grpc_predict_v2.proto (the KServe v2 inference protocol,
tensor workers): run `python protos/generate.py`."""
