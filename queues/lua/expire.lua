--[[ expire: the deadline sweep, one request at a time (every worker's heartbeat, and the API
for its own waiting client). A request still waiting for its first claim past its queue
deadline leaves the queue (see `expire` in _lib.lua); an entry of the deadlines set whose request
was claimed, cancelled or is gone is dropped from it.
Moves: waiting -> expired
KEYS: waiting zset, deadlines zset, request hash, output stream, metrics hash
ARGV: request id, now (ms), retention (s)
Returns (ExpireResult) EXPIRED now, or NOT_DUE (not yet due, or no longer waiting for its
first claim). ]]
local waiting, deadlines, req, out, metrics = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, now, ttl = ARGV[1], ARGV[2], ARGV[3]
local NOT_DUE, EXPIRED = 0, 1

if overdue(req, now) then
  expire(waiting, deadlines, req, out, metrics, id, now, tonumber(ttl))
  return EXPIRED
end
local h = redis.call('HMGET', req, 'status', 'attempts')
if h[1] ~= 'waiting' or h[2] ~= '0' then
  redis.call('ZREM', deadlines, id)
end
return NOT_DUE
