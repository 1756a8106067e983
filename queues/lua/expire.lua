--[[ expire: the deadline sweep, one request at a time (every worker's heartbeat, and the API
for its own waiting client). A request still waiting for its first claim past its queue
deadline leaves the queue (see `expire` in _lib.lua); an entry of the deadlines set whose request
was claimed, cancelled or is gone is dropped from it.
Moves: waiting -> expired
KEYS[1] waiting zset   KEYS[2] deadlines zset   KEYS[3] request hash   KEYS[4] output stream
KEYS[5] metrics hash
ARGV[1] id   ARGV[2] now (ms)   ARGV[3] retention (s)
Returns 1 expired now, 0 not (not yet due, or no longer waiting for its first claim). ]]
if overdue(KEYS[3], ARGV[2]) then
  expire(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], ARGV[2], tonumber(ARGV[3]))
  return 1
end
local h = redis.call('HMGET', KEYS[3], 'status', 'attempts')
if h[1] ~= 'waiting' or h[2] ~= '0' then
  redis.call('ZREM', KEYS[2], ARGV[1])
end
return 0
