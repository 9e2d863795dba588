"""Our own tensor worker: the KServe v2 gRPC inference service (`server`) over an ONNX model
run by onnxruntime (`onnx_engine`, the `tensor` extra), behind what the servicer needs of an
engine (`engine`); the demo's pure-Python affine model (`demo`) needs neither."""
