--[[ requeue: a claimed request whose lease ran out goes back to waiting, in its original place
(same member, so same sequence number and priority).
KEYS[1] running zset   KEYS[2] waiting zset   KEYS[3] request hash
ARGV[1] id   ARGV[2] now (ms)
Returns 1 when requeued, 0 when the lease was renewed or the request ended meanwhile. ]]
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not deadline or tonumber(deadline) > tonumber(ARGV[2]) then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[3], 'status') ~= 'running' then
  return 0
end
local priority = tonumber(redis.call('HGET', KEYS[3], 'priority'))
local member = redis.call('HGET', KEYS[3], 'member')
redis.call('HSET', KEYS[3], 'status', 'waiting', 'worker', '', 'slot', '', 'requeued_ms', ARGV[2])
redis.call('HINCRBY', KEYS[3], 'requeues', 1)
redis.call('ZADD', KEYS[2], -priority, member)
return 1
