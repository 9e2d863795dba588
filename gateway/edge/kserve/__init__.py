"""The KServe v2 inference protocol's REST side, for tensor models (`routes`)."""
