"""Wire protocol between gateways and engines: msgpack messages and Redis key names.

Both sides import it (it imports no torch); nothing here pickles. Every message carries `v`
(PROTOCOL_VERSION); a message with another version is rejected with `ProtocolError`, and so is
any other message that does not decode: every `decode` raises only `ProtocolError`, whatever
the bytes (`fields`), so a reader dead-letters what it cannot read and goes on.

Flow (protocol version 2; see `docs/stream-layout.md` for the layout and the migration from 1):
- gateway ``XADD {prefix}:{m:<model>}:requests * m <EngineRequest.encode()>``: one stream and one
  consumer group ``engines`` per served model name, so a request only reaches engines of its
  model and only they take over each other's entries. The gateway's submit script refuses
  the XADD past the model's queue bound (429) and when Redis lost its data (epoch changed).
- engine ``XADD {prefix}:{g:<gateway_id>}:out MAXLEN ~ N * m <encode_outputs([...])>``: one entry
  per step per gateway on the gateway's output *stream*, read by id, so output written while
  a gateway reconnects is read afterwards, never lost; ``seq`` counts messages per request.
- gateway ``PUBLISH {prefix}:abort <AbortMessage.encode()>`` when a client leaves or a stop
  string matched.
- gateway ``SET {prefix}:{g:<gateway_id>}:gateway PX ttl``: liveness; engines drop the requests
  of a gateway whose key is gone.
- ``{prefix}:{m:<model>}:epoch``: a random token set once per dataset of the model's slot; a
  changed or missing token means Redis restarted without persistence and every in-flight
  request of the model is lost.
- engine ``SET {prefix}:{m:<model>}:alive:<engine_id> PX ttl`` (takeovers need it gone; the
  engine's flushes are fenced on it), ``HSET {prefix}:{e:<engine_id>}:engine``
  (EngineHeartbeat.to_hash()) with a TTL, and ``ZADD {prefix}:engines <time> <engine_id>`` in
  the same MULTI/EXEC (one per slot on a Redis Cluster): readers discover engines from that
  sorted set, never by SCAN (`common.engine_set`).
- engine ``RPUSH {prefix}:{g:<gateway_id>}:progress:<request_id> <OutputMessage.checkpoint().encode()>``
  in the same MULTI/EXEC as each output (tokens and finish state only), with a TTL; `merge_progress`
  folds the list back.
- ``{prefix}:{m:<model>}:dead``: dead-letter stream of entries no engine could serve (undecodable,
  or taken over too many times), with the reason and the raw bytes.

The braces are Redis Cluster hash tags (`keys`): the keys each script or transaction touches
share one slot.

Modules: `fields` (checked decoding), `keys`, `request` (EngineRequest, AbortMessage),
`output` (OutputMessage and its parts, progress), `heartbeat`.
"""

from common.protocol.fields import PROTOCOL_VERSION, ProtocolError
from common.protocol.heartbeat import REASONING_PARSER_NAMES, EngineHeartbeat
from common.protocol.keys import CONSUMER_GROUP, DEFAULT_PREFIX, REQUEST_FIELD, Keys
from common.protocol.output import (
    ErrorInfo,
    OutputGap,
    OutputMessage,
    Progress,
    SeqOutput,
    TokenLogprob,
    Usage,
    decode_outputs,
    encode_outputs,
    merge_progress,
    num_repeated,
)
from common.protocol.request import AbortMessage, EngineRequest

__all__ = [
    "CONSUMER_GROUP", "DEFAULT_PREFIX", "PROTOCOL_VERSION", "REASONING_PARSER_NAMES", "REQUEST_FIELD", "AbortMessage",
    "EngineHeartbeat",
    "EngineRequest", "ErrorInfo", "Keys", "OutputGap", "OutputMessage", "Progress", "ProtocolError", "SeqOutput",
    "TokenLogprob", "Usage", "decode_outputs", "encode_outputs", "merge_progress", "num_repeated",
]
