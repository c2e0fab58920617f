"""`/v1/rooms`: allocate, bind to a prefill dp rank, abort, look up."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from kvhandoff.bootstrap_server.deps import StateDep, WriteAuth
from kvhandoff.bootstrap_server.schemas import (
    ROOM_MAX,
    RoomAbort,
    RoomBind,
    RoomPublic,
    RoomsAllocate,
    RoomsAllocated,
)
from kvhandoff.bootstrap_server.views import room_public

rooms = APIRouter(prefix="/v1/rooms", tags=["rooms"])

RoomPath = Annotated[int, Path(ge=0, le=ROOM_MAX, description="Room id (63-bit).")]


@rooms.post("", dependencies=[WriteAuth], responses={401: {"description": "Bad token."}})
async def allocate(body: RoomsAllocate, state: StateDep) -> RoomsAllocated:
    """Allocate `count` random 63-bit room ids, none in use."""
    return RoomsAllocated(rooms=state.registry.allocate_rooms(body.count))


@rooms.get("/{room}", responses={404: {"description": "Unknown or forgotten room."}})
async def lookup(room: RoomPath, state: StateDep) -> RoomPublic:
    """A room's state; an aborted room says why."""
    return room_public(state.registry.room(room), state.clock())


@rooms.post("/{room}/bind", dependencies=[WriteAuth],
            responses={404: {"description": "Unknown engine."},
                       409: {"description": "Room aborted or bound elsewhere."}})
async def bind(room: RoomPath, body: RoomBind, state: StateDep) -> RoomPublic:
    """Bind a room to the prefill engine's dp rank that serves it."""
    rr = state.registry.bind_room(room, body.engine_id, body.dp_rank)
    return room_public(rr, state.clock())


@rooms.post("/{room}/abort", dependencies=[WriteAuth])
async def abort(room: RoomPath, body: RoomAbort, state: StateDep) -> RoomPublic:
    """Record that a room was aborted, with why (the first reason wins)."""
    return room_public(state.registry.abort_room(room, body.reason), state.clock())
