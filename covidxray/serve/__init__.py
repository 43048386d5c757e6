"""`covidxray serve`: a page and an HTTP API in front of predict's own code path, for a browser on the network.

Flask (routing, multipart parsing) under waitress (a pure-Python WSGI server with a fixed thread pool), so it
installs wherever the edge install does (`covidxray[serve]`). No TensorFlow: an upload goes through
covidxray/edge/predict.py exactly as a file given to `covidxray predict`, from memory (never written to disk
unless `--keep` says so), and the Grad-CAM overlay comes from the model's class maps
(covidxray/edge/class_maps.py).
"""
