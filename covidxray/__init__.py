"""covidxray: public chest X-ray data in, a Pi-deployable classifier out."""

__version__ = "0.1.0"
