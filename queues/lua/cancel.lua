--[[ cancel: the client is gone (or asked to stop). A waiting request leaves the queue at once;
a running one is marked, and its worker frees the slot at its next step (it reads the status).
Moves: waiting -> cancelled
KEYS: waiting zset, request hash, output stream, deadlines zset
ARGV: now (ms), retention (s), request id
Returns the status the request had: 'waiting', 'running', or the final status it already had
('' when unknown): queues/scripts.py reads it as a RequestStatus (None for ''). ]]
local waiting, req, out, deadlines = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, ttl, id = ARGV[1], ARGV[2], ARGV[3]

local status = redis.call('HGET', req, 'status')
if not status then
  return ''
end
if status == 'waiting' then
  redis.call('ZREM', waiting, redis.call('HGET', req, 'member'))
  -- its queue deadline no longer matters; the sweep would drop it too, one heartbeat later
  redis.call('ZREM', deadlines, id)
  redis.call('HSET', req, 'status', 'cancelled', 'finished_ms', now)
  redis.call('XADD', out, '*', unpack(cancelled_event()))
  if tonumber(ttl) > 0 then
    redis.call('EXPIRE', req, ttl)
    redis.call('EXPIRE', out, ttl)
  end
elseif status == 'running' then
  redis.call('HSET', req, 'cancel_requested_ms', now)
end
return status
