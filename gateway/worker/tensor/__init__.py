"""Our own tensor worker: the KServe v2 gRPC inference service (`server`) over an ONNX model
run by onnxruntime (`onnx_engine`, the `tensor` extra)."""
