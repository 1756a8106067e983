--[[ requeue: a claimed request goes back to waiting in its original place (same member and the
score it was enqueued with: same sequence number, priority and, with aging, arrival), and
whoever claims it next resumes after what its stream holds.
Moves: running -> waiting, running -> failed, running -> cancelled
Three callers: any worker, for a claim whose lease ran out (its worker died or froze); a worker
stopping cleanly, for its own claims; a worker that knows another on its host died (dead pid).
KEYS[1] running zset   KEYS[2] waiting zset   KEYS[3] request hash   KEYS[4] output stream
KEYS[5] metrics hash
ARGV[1] id   ARGV[2] now (ms)   ARGV[3] most claims a request may lose (0 = no limit)
ARGV[4] retention (s) of a request that ends here
ARGV[5] '' = only if its lease ran out; else the worker that must hold it now
ARGV[6] the claim_seq that worker must hold ('' = any of its claims)
ARGV[7] '1' when the claim was lost (its worker died), '0' when handed back cleanly
Returns 1 requeued, 2 ended: failed (it lost too many claims: worker_lost) or cancelled (its
client asked while its worker was gone), 0 nothing to do (lease renewed, not that owner, or
already ended). ]]
if ARGV[5] == '' then
  local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
  if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then
    return 0
  end
else
  local h = redis.call('HMGET', KEYS[3], 'status', 'worker', 'claim_seq')
  if h[1] ~= 'running' or h[2] ~= ARGV[5] or (ARGV[6] ~= '' and h[3] ~= ARGV[6]) then
    return 0
  end
end
if redis.call('HGET', KEYS[3], 'status') ~= 'running' then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return 0
end
local lost = 0
if ARGV[5] == '' or ARGV[7] == '1' then
  lost = redis.call('HINCRBY', KEYS[3], 'claims_lost', 1)
end
local ttl = tonumber(ARGV[4])
local done = redis.call('HGET', KEYS[3], 'completion_tokens') or '0'
if redis.call('HEXISTS', KEYS[3], 'cancel_requested_ms') == 1 then
  close(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'cancelled', ARGV[2], ttl, done, 'cancelled',
    {'type', 'error', 'message', 'cancelled', 'code', 'cancelled'})
  return 2
end
local most = tonumber(ARGV[3])
if most > 0 and lost >= most then
  close(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[1], 'failed', ARGV[2], ttl, done, 'worker_lost',
    {'type', 'error', 'code', 'worker_lost',
     'message', 'the request was lost by ' .. lost .. ' workers in a row (they died or froze while running it)'})
  return 2
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[3], 'status', 'waiting', 'worker', '', 'slot', '', 'requeued_ms', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'requeues', 1)
local place = redis.call('HMGET', KEYS[3], 'score', 'priority', 'member')
redis.call('ZADD', KEYS[2], place[1] or -tonumber(place[2]), place[3])
return 1
