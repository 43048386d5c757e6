"""`covidxray report`: a run's model card as one self-contained HTML page (covidxray/report/build.py)."""
