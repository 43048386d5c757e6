"""What runs on a board that only classifies: decode, the input gate, the LiteRT interpreter, predict.

Contract: nothing in this package imports TensorFlow, Keras or Horovod (the
edge install has none of them; tests/test_contracts.py imports every module
here in a fresh interpreter to check). `prepare` uses the same `preprocess`
and `radiograph_gate`, so training and inference see pixels made by the same
code; PREPROCESSING_VERSION names that code. Only `predict --explain` reaches
outside, to the Keras model, and only when asked.
"""
