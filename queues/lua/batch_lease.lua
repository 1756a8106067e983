--[[ batch_lease: take, renew or release the right to run a batch (one RQ job at a time).
KEYS: batch lease key
ARGV: the job's token, lease length (ms; 0 releases it)
Returns (LeaseResult) HELD when the token holds the lease now (taken or renewed; or released),
TAKEN when another job's token holds it. A job that died stops renewing; once its lease has run
out a new job may take the batch over. ]]
local lease = KEYS[1]
local token, ms = ARGV[1], ARGV[2]
local TAKEN, HELD = 0, 1

local holder = redis.call('GET', lease)
if holder and holder ~= token then
  return TAKEN
end
if tonumber(ms) <= 0 then
  redis.call('DEL', lease)
else
  redis.call('SET', lease, token, 'PX', ms)
end
return HELD
