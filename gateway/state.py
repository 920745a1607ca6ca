"""Typed application keys: everything a handler needs lives on the app, nothing in modules."""

from __future__ import annotations

from aiohttp import web

from gateway.broker.broker import Broker
from gateway.broker.engines import EngineRegistry
from gateway.config import GatewayConfig
from gateway.drain import Drain
from gateway.metrics import GatewayMetrics

CONFIG = web.AppKey("config", GatewayConfig)
METRICS = web.AppKey("metrics", GatewayMetrics)
BROKER = web.AppKey("broker", Broker)
REGISTRY = web.AppKey("registry", EngineRegistry)
DRAIN = web.AppKey("drain", Drain)
