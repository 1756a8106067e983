--[[ cancel: the client is gone (or asked to stop). A waiting request leaves the queue at once;
a running one is marked, and its worker frees the slot at its next step (it reads the status).
Moves: waiting -> cancelled
KEYS[1] waiting zset   KEYS[2] request hash   KEYS[3] output stream   KEYS[4] deadlines zset
ARGV[1] now (ms)   ARGV[2] retention (s)   ARGV[3] id
Returns the status the request had: 'waiting', 'running', or the final status it already had
('' when unknown). ]]
local status = redis.call('HGET', KEYS[2], 'status')
if not status then
  return ''
end
if status == 'waiting' then
  redis.call('ZREM', KEYS[1], redis.call('HGET', KEYS[2], 'member'))
  -- its queue deadline no longer matters; the sweep would drop it too, one heartbeat later
  redis.call('ZREM', KEYS[4], ARGV[3])
  redis.call('HSET', KEYS[2], 'status', 'cancelled', 'finished_ms', ARGV[1])
  redis.call('XADD', KEYS[3], '*', 'type', 'error', 'message', 'cancelled', 'code', 'cancelled')
  local ttl = tonumber(ARGV[2])
  if ttl > 0 then
    redis.call('EXPIRE', KEYS[2], ttl)
    redis.call('EXPIRE', KEYS[3], ttl)
  end
elseif status == 'running' then
  redis.call('HSET', KEYS[2], 'cancel_requested_ms', ARGV[1])
end
return status
