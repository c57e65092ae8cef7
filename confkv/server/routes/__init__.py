"""The server's routes by family: ``openai`` (models, completions, chat), ``policy`` (the cache policy API),
``sessions`` (forgetting a session), ``ops`` (health and metrics). Each module holds one ``APIRouter``."""
