"""python -m api: serve with settings from STRATA_* environment variables."""

from api.app import run
from api.settings import ApiSettings

if __name__ == "__main__":
    run(ApiSettings())
