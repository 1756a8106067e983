--[[ Shared by the scripts that need them; queues/scripts.py puts this file in front of each.
owns: the request hash says this worker holds this claim (the fence every worker write passes).
close: a request ends: it leaves the running set, gets its final status and reason, its last
event (if any) is appended, it is counted once in the metrics hash, and it is kept `ttl` s.
expire: a waiting request's queue deadline passed before any worker claimed it: it leaves the
queue and the deadlines set, ends `expired` with a queue_timeout error event, is counted as
requests:<p>:expired, and is kept `ttl` s.
overdue: the request waits for its first claim and its queue deadline is at or before `now`.
cancelled_event: the last event of a request its client cancelled, the one definition of it
(cancel.lua, finish.lua, requeue.lua). ]]
local function cancelled_event()
  return {'type', 'error', 'message', 'cancelled', 'code', 'cancelled'}
end

local function owns(req, worker, claim_seq)
  local h = redis.call('HMGET', req, 'status', 'worker', 'claim_seq')
  return h[1] == 'running' and h[2] == worker and h[3] == claim_seq
end

local function close(running, req, out, metrics, id, status, now, ttl, completion_tokens, reason, event)
  redis.call('ZREM', running, id)
  redis.call('HSET', req, 'status', status, 'finished_ms', now,
    'completion_tokens', completion_tokens, 'finish_reason', reason)
  if #event > 0 then
    redis.call('XADD', out, '*', unpack(event))
  end
  local p = redis.call('HGET', req, 'priority') or '0'
  redis.call('HINCRBY', metrics, 'requests:' .. p .. ':' .. status, 1)
  if ttl > 0 then
    redis.call('EXPIRE', req, ttl)
    redis.call('EXPIRE', out, ttl)
  end
  return p
end

local function overdue(req, now)
  local h = redis.call('HMGET', req, 'status', 'attempts', 'queue_deadline_ms')
  local deadline = tonumber(h[3])
  return h[1] == 'waiting' and h[2] == '0' and deadline ~= nil and deadline <= tonumber(now)
end

local function expire(waiting, deadlines, req, out, metrics, id, now, ttl)
  redis.call('ZREM', waiting, redis.call('HGET', req, 'member'))
  redis.call('ZREM', deadlines, id)
  local h = redis.call('HMGET', req, 'priority', 'enqueued_ms', 'queue_deadline_ms')
  redis.call('HSET', req, 'status', 'expired', 'finished_ms', now, 'finish_reason', 'queue_timeout')
  redis.call('XADD', out, '*', 'type', 'error', 'code', 'queue_timeout', 'message',
    'The request waited ' .. (tonumber(h[3]) - tonumber(h[2])) / 1000 ..
    ' s (its queue_timeout) without getting a slot; retry later or at a higher priority.')
  redis.call('HINCRBY', metrics, 'requests:' .. (h[1] or '0') .. ':expired', 1)
  if ttl > 0 then
    redis.call('EXPIRE', req, ttl)
    redis.call('EXPIRE', out, ttl)
  end
end
