--[[ finish: a request ends (done, failed, or cancelled by its client); its slot is free.
KEYS[1] running zset   KEYS[2] request hash   KEYS[3] output stream
ARGV[1] id   ARGV[2] worker id   ARGV[3] final status (finished|failed|cancelled)
ARGV[4] now (ms)   ARGV[5] retention (s) of the hash and stream after the end
ARGV[6] completion tokens   ARGV[7] finish reason
ARGV[8..] the last stream event as field, value pairs (none for a cancel)
Returns 1, or 0 when this worker no longer owns the request (its lease expired and it was
requeued): then nothing is written, so a request never ends twice. ]]
if redis.call('HGET', KEYS[2], 'worker') ~= ARGV[2] or redis.call('HGET', KEYS[2], 'status') ~= 'running' then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'status', ARGV[3], 'finished_ms', ARGV[4],
  'completion_tokens', ARGV[6], 'finish_reason', ARGV[7])
if #ARGV >= 8 then
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, 8))
end
local ttl = tonumber(ARGV[5])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
end
return 1
