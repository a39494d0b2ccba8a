"""Weight quantization at load time: calibration (:mod:`workers.quant.calibrate`) and quantized
checkpoints (:mod:`workers.quant.store`). The per-format math lives in
:mod:`workers.layers.quant`; docs/quantization.md describes the formats."""
