"""Controller training (datamodule, Lightning module, replay simulator, ONNX export)."""
