"""One APIRouter per resource: ranks, engines, rooms, route, health, sglang."""
